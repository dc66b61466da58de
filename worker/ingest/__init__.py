"""Bulk files in and out: a file streamed into the store a chunk at a time (parsed in process or
in a parsing process on the second core), and the output file written in input-line order."""
