"""Stages used by the tests, loaded the way a user's plugin is (``plugins=[...]``)."""
