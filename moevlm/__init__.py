"""moevlm: a PyTorch trainer for Mixture-of-Experts vision-language models."""

__version__ = "0.1.0"
