package topology

// Unselected reports whether no consumer's filter accepts an event with
// these message attributes: SNS accepts such a publish and delivers it
// nowhere, without telling anyone. Publishers use it to report the event
// the way the other transports do (transport.UnroutedDeliver: counted as
// delivered, logged, alarmed on).
func (t Topology) Unselected(attrs map[string]string) bool {
	for _, c := range t.Consumers {
		if c.Matches(attrs) {
			return false
		}
	}
	return true
}
