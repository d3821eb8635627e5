package sns_test

import (
	"context"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/sns"
)

// SNS settings are checked when the transport opens, each error naming its
// variable; what only one use needs (a topic to publish, a DLQ for the
// consumer function) is checked when that use asks for it.
func TestOpenFromEnv(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		wantErr string
	}{
		{"defaults", nil, ""},
		{"consumer settings", map[string]string{"FIFOBOX_CONSUMER_ORDER": "relaxed", "FIFOBOX_MAX_RECEIVE_COUNT": "5", "FIFOBOX_LOG_AGGREGATE_IDS": "true"}, ""},
		{"bad order", map[string]string{"FIFOBOX_CONSUMER_ORDER": "loose"}, "FIFOBOX_CONSUMER_ORDER"},
		{"bad max receive", map[string]string{"FIFOBOX_MAX_RECEIVE_COUNT": "0"}, "FIFOBOX_MAX_RECEIVE_COUNT"},
		{"retry budget and backstop", map[string]string{"FIFOBOX_MAX_RETRIES": "4", "FIFOBOX_MAX_RECEIVE_COUNT": "100"}, ""},
		{"bad max retries", map[string]string{"FIFOBOX_MAX_RETRIES": "four"}, "FIFOBOX_MAX_RETRIES"},
		{"max retries out of range", map[string]string{"FIFOBOX_MAX_RETRIES": "51"}, "FIFOBOX_MAX_RETRIES"},
		{"max retries not below max receive", map[string]string{"FIFOBOX_MAX_RETRIES": "5", "FIFOBOX_MAX_RECEIVE_COUNT": "5"}, "FIFOBOX_MAX_RETRIES=5: must be below FIFOBOX_MAX_RECEIVE_COUNT"},
		{"bad log flag", map[string]string{"FIFOBOX_LOG_AGGREGATE_IDS": "maybe"}, "FIFOBOX_LOG_AGGREGATE_IDS"},
		{"bad queues", map[string]string{"FIFOBOX_QUEUES": `{"c":{"queue_url":"q"}}`}, "FIFOBOX_QUEUES"},
		{"local without an endpoint", map[string]string{"local": "1"}, "AWS_ENDPOINT_URL"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			for _, v := range transport.RegisteredEnv() {
				t.Setenv(v.Name, "")
			}
			t.Setenv("AWS_ENDPOINT_URL", "")
			t.Setenv("AWS_REGION", "us-east-1")
			for k, v := range tt.env {
				if k != "local" {
					t.Setenv(k, v)
				}
			}
			tr, err := transport.Open(context.Background(), transport.Options{Local: tt.env["local"] != ""})
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case err == nil && tr.Kind() != transport.SNS:
				t.Fatalf("kind %s", tr.Kind())
			}
		})
	}
}

func TestPublisherNeedsATopic(t *testing.T) {
	tr, err := sns.New(sns.Config{SNS: &fakeSNS{}, SQS: noSQS{}})
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Publisher(); err == nil || !strings.Contains(err.Error(), "FIFOBOX_TOPIC_ARN") || !strings.Contains(err.Error(), "FIFOBOX_TRANSPORT=sns") {
		t.Fatalf("no topic: error %v, want one naming FIFOBOX_TOPIC_ARN and FIFOBOX_TRANSPORT=sns", err)
	}
	tr, _ = sns.New(sns.Config{SNS: &fakeSNS{}, SQS: noSQS{}, TopicARN: "arn:aws:sns:us-east-1:000000000000:events.fifo"})
	if p, err := tr.Publisher(); err != nil || p == nil {
		t.Fatalf("with a topic: %v", err)
	}
}

// noSQS is an SQS client nothing calls.
type noSQS struct{ sns.SQSAPI }
