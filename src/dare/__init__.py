"""dare: post-train and evaluate diffusion LLMs in one executor."""
__version__ = "0.1.0"
