from pairclean.cli import main

main()
