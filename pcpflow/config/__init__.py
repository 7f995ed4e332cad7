"""The run configuration: ``run`` (RunConfig and its rules) and ``hardware`` (what a simulated
run prices on, and how). Settings models only: both the executed and the priced run read
them, neither is imported here.
"""
