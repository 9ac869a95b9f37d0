from specdecode.cli import main

main()
