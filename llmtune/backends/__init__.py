"""Backends execute graph ops: cpu (numpy), cuda (cupy)."""
