from moepipe.cli import main

main()
