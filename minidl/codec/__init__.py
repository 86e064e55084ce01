"""Codecs: encodings of arrays, knowing nothing of networks or plans (a floor just above the errors)."""
