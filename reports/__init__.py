"""Rendering records into reports (render.py) and comparing two runs (compare.py).

reports/reference/ holds the committed reference report; `xdeploy run` writes reports/latest/."""
