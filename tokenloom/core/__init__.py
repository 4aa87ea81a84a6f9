"""The scheduling brain: pure Python, imports no torch. Shared by the engine and the simulator."""
