"""A stateless router over engine groups: the public API in, schedulers out (see service.py)."""
