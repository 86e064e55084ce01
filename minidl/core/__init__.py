"""The vocabulary every floor speaks: symbols, tensor specs and roles, units, errors, the divergence guards. Imports
nothing else of minidl."""
