"""Learning and measuring drafting: frames recorded from synthesis, drafts and drafters, offset training,
acceptance and trees calibrated on data, drafters compared, random-weight checkpoints, the stand-in."""
