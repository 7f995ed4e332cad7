"""The driver: ``cli`` (``python -m pcpflow``), ``compose`` and ``help`` (configs and
their messages), ``checks`` (everything found wrong before a rank starts), ``job`` (one
job), ``launch`` (its ranks), ``sweep`` (the sweep report), ``interrupted`` (a command
interrupted before its run started).
"""
