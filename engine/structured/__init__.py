"""Structured output: a request's grammar (JSON schema, regex, choice, EBNF) constrains its tokens.

``params`` is the request side (vLLM's ``StructuredOutputsParams``), ``compiler`` turns it into a
compiled grammar off the loop thread (cached, time-limited), ``state`` is one sample's matcher
(advance, roll back, forced continuations) and ``mask`` applies every row's mask in one
tensor operation per step. The grammar library is xgrammar (chosen by measured mask time:
``bench/grammar_mask.py``).
"""
