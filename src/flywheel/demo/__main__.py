from flywheel.demo.run import main

main()
