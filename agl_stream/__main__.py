from agl_stream.cli import main

main()
