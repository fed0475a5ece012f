"""`cudadoctor build`: a pure plan (plan.py), then a Docker or local backend, verification (verify.py)
and the wheel's label and manifest (manifest.py). Entry point: execute.build(BuildRequest, console)."""
