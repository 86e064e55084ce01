"""Codecs: lossless and error-bounded lossy encodings of arrays, with no knowledge of networks or plans.

A floor of its own, just above the errors: the memory decisions (`memory.decisions.compress`) and the backends
use it, it uses nothing of theirs.
"""
