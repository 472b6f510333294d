from polyrl.serve.main import main

main()
