"""A job's request: outside dicts, OpenAI Batch lines, table rows (``table_rows``: a prompt
column or a template) and chat messages made into the engine's request model, the checks a
request must pass before it is stored, and what a result looks like on the way out (output
lines, logprobs, structured-output rechecks)."""
