"""The experiments of issue 10's results table: one module per measurement, each returning rows."""
