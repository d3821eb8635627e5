package sns_test

import (
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport/sns"
)

func TestParseQueues(t *testing.T) {
	q, err := sns.ParseQueues(`{"b":{"queue_url":"qb","dlq_url":"db"},"a":{"queue_url":"qa","dlq_url":"da","subscription_dlq_url":"sa"}}`)
	if err != nil || len(q) != 2 || q["a"].SubscriptionDLQURL != "sa" || strings.Join(q.Names(), ",") != "a,b" {
		t.Fatalf("%+v %v", q, err)
	}
	for _, bad := range []string{`{"c":{"queue_url":"q"}}`, `[1]`} {
		if _, err := sns.ParseQueues(bad); err == nil || !strings.Contains(err.Error(), "FIFOBOX_QUEUES") {
			t.Errorf("%s: error %v, want one naming FIFOBOX_QUEUES", bad, err)
		}
	}
	if q, err := sns.ParseQueues(""); err != nil || len(q) != 0 {
		t.Errorf("unset: %+v %v", q, err)
	}
}
