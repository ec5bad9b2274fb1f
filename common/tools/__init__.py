"""Tools for multi-turn episodes: plain Python functions as tools with JSON schemas (functions.py), tool calls
parsed from and written in each chat-template family's format (calls.py), and a sandboxed Python-execution tool
(python_sandbox.py). See docs/tools.md."""
