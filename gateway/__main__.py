from gateway.cli import app

if __name__ == "__main__":  # the engine-core process re-imports this module under spawn
    app()
