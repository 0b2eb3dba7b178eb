"""The offline plots page: ``python -m reports.build`` (see build.py)."""
