"""moelens: look inside Mixture-of-Experts language models and change what they do."""
