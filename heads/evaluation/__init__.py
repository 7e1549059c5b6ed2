"""Evaluation: TOFU metrics of a profile (`evaluate`), text metrics (`metrics`), teacher-forced scoring
(`scoring`), the quality tables (`ablation`) and the speed bench (`bench`)."""
