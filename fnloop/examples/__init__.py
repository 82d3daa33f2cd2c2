"""Runnable examples. The main job: ``python -m fnloop.examples.digits`` (see ``docs/example.md``)."""
