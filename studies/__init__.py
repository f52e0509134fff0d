"""One-off studies: thin scripts over the library (`python -m xdeploy.studies.NAME`) whose figures are in docs/."""
