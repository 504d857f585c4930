"""tgi dialect: schemas and routes."""
