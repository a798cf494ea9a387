"""`dskit data prepare` and the sampler the trainer reads shards with (dskit/data/)."""
