"""The main job's building blocks (``apps/train.py`` is the command line over them).

See ``docs/training.md`` for how the loop, the strategies and ``summary.json`` fit together.
"""
