"""Type stub of the compiled module ``mesharray._core`` (checked against the binary by tests/core/test_stub.py)."""
