"""The stages a recipe is made of (one module each) and the options each takes."""



