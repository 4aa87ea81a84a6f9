"""exit_without_teardown (tokenloom/process_exit.py): the `tokenloom` program and the engine process leave
without the interpreter's teardown, but keep what a normal exit does that matters."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path


def _run(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "child.py"
    script.write_text(textwrap.dedent(code))
    return subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=60)


def test_exit_code_atexit_callbacks_and_buffered_output_are_kept(tmp_path: Path) -> None:
    done = _run("""
        import atexit, sys, tempfile, weakref
        from pathlib import Path
        from tokenloom.process_exit import exit_without_teardown
        out = Path(sys.argv[1])
        order = []
        atexit.register(lambda: (out / "atexit").write_text(" ".join(order + ["atexit"])))
        atexit.register(lambda: order.append("registered-last-runs-first"))
        kept = tempfile.TemporaryDirectory(dir=out)  # removed by its weakref.finalize at exit
        (out / "tmpdir").write_text(kept.name)
        sys.stdout.write("buffered, no newline")
        sys.stderr.write("to stderr")
        exit_without_teardown(3)
        """, tmp_path)
    assert done.returncode == 3, done.stderr
    assert done.stdout == "buffered, no newline" and done.stderr == "to stderr"
    assert (tmp_path / "atexit").read_text() == "registered-last-runs-first atexit"
    assert not Path((tmp_path / "tmpdir").read_text()).exists()


def test_a_running_non_daemon_thread_is_waited_for(tmp_path: Path) -> None:
    done = _run("""
        import sys, threading, time
        from pathlib import Path
        from tokenloom.process_exit import exit_without_teardown
        def work():
            time.sleep(0.3)
            (Path(sys.argv[1]) / "thread").write_text("finished")
        threading.Thread(target=work).start()
        exit_without_teardown(0)
        """, tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "thread").read_text() == "finished"


def test_the_program_exits_with_mains_code() -> None:
    bad = subprocess.run([sys.executable, "-m", "tokenloom", "serve", "--no-such-flag"], capture_output=True,
                         text=True, timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --no-such-flag" in bad.stderr
    usage = subprocess.run([sys.executable, "-m", "tokenloom"], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage: tokenloom" in usage.stdout
