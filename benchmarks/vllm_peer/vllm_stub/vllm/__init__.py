"""The few vLLM names the peer tests import for plumbing, answered for the model tokenloom serves.

Only used when vLLM itself is not installed (the runner puts this directory on the path then). A test
asking vLLM for "its" model's vocabulary or tokenizer gets the served model's: the model name is
plumbing, as in remote_server.py.
"""
