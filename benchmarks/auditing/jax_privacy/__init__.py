"""Side-by-side empirical ε lower bounds: this toolkit vs jax_privacy 2.0 on seeded Gaussian scores."""
