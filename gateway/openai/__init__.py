"""openai dialect: schemas and routes."""
