"""Presentation: every table, report, progress bar and JSON writer the CLI shows or writes."""
