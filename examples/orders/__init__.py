"""Example orders service: SQLAlchemy models and transactional service functions."""
