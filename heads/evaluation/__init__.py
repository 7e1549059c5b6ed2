"""Evaluation: TOFU metrics of a profile (`evaluate`), text metrics (`metrics`), teacher-forced scoring
(`scoring`), facts from templates (`facts`). The benches that use them are in `lethe.server.bench`."""
