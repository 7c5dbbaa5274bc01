"""The engine's link to the prefix index service and the prefix policy it steers."""
