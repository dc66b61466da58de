"""Bulk files in and out: a file or a table (Parquet, CSV, a Hugging Face dataset, JSONL
records; ``tables``) streamed into the store a chunk at a time (parsed in process or in a
parsing process on the second core), and the output written in input order: JSONL lines
(``output``) or the input's table with the result columns beside it (``table_output``)."""
