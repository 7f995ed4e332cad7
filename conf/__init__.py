"""pcpflow's Hydra configs (installed as the package data ``pcpflow.conf``)."""
