"""The pipeline a step flows through: ``state`` (the step state), ``stage`` (the stage protocol
and registry), ``context`` (what every stage of a rank sees), ``assemble`` (a pipeline from
the config).
"""
