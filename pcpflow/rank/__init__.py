"""One rank process: ``bootstrap`` (every way a rank starts), ``engine`` (the step loop),
``verify`` (the single-rank reference in lockstep), ``progress`` (where each rank is, and
who is to blame), ``devices``, ``cudagraph``.
"""
