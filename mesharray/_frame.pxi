# _frame: see _core.pyx
