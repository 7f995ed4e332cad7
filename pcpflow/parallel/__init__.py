"""The rank grid and what crosses it: ``grid`` (tp x pcp, the groups and their rules), ``comm``
(collectives counted by purpose), ``tensor_parallel`` (sharded layers), ``moe_dispatch``
(experts under PCP).
"""
