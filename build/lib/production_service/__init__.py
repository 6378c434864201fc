"""The inference service: an OpenAI-compatible Flask app over the lmops engine,
served by gunicorn (`production_service.app:create_app()`, config in
production_service/gunicorn.conf.py). Kept import-free, so gunicorn's master
never loads torch or the engine: only the forked worker does."""
