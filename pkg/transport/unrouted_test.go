package transport_test

import (
	"os"
	"regexp"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport"
)

// The deployment counts unrouted events by matching this log message (a
// metric filter in infra/, its own module, which repeats the string): a
// changed message would leave the UnroutedEvents alarm silent for ever.
func TestInfraCountsTheUnroutedLogLine(t *testing.T) {
	src, err := os.ReadFile("../../infra/stacks/alarms_stateful.go")
	if err != nil {
		t.Skipf("infra module not present: %v", err)
	}
	m := regexp.MustCompile(`(?m)^\s*(?:const\s+)?UnroutedLogMessage\s*=\s*"([^"]*)"`).FindSubmatch(src)
	if m == nil {
		t.Fatal("infra/stacks/alarms_stateful.go no longer declares UnroutedLogMessage")
	}
	if string(m[1]) != transport.UnroutedLogMessage {
		t.Fatalf("infra counts %q, the publishers log %q", m[1], transport.UnroutedLogMessage)
	}
}

func TestCheckUnroutedPolicy(t *testing.T) {
	for p, ok := range map[string]bool{"": true, "deliver": true, "alternate": true, "drop": false, "Deliver": false} {
		if err := transport.CheckUnroutedPolicy(p); (err == nil) != ok {
			t.Errorf("CheckUnroutedPolicy(%q) = %v", p, err)
		}
	}
}
