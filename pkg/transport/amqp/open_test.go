package amqp_test

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/transport"
	"github.com/fifobox/fifobox/pkg/transport/amqp"
	_ "github.com/fifobox/fifobox/pkg/transport/nats"
	_ "github.com/fifobox/fifobox/pkg/transport/sns"
)

// clearTransportEnv unsets every variable transport.Open may read (the
// machine running the test may set some).
func clearTransportEnv(t *testing.T) {
	t.Helper()
	for _, v := range transport.RegisteredEnv() {
		t.Setenv(v.Name, "")
	}
	t.Setenv("AWS_REGION", "us-east-1")
}

func TestOpenFromEnv(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		want    transport.Kind
		wantErr string // a variable the error must name
	}{
		{"default is sns", nil, transport.SNS, ""},
		{"rabbitmq", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_URL": "amqps://b-1.mq.us-east-1.amazonaws.com:5671"}, transport.RabbitMQ, ""},
		{"rabbitmq topology as JSON", map[string]string{"FIFOBOX_TRANSPORT": "RabbitMQ", "FIFOBOX_AMQP_TOPOLOGY": `{"exchange":{"name":"x","kind":"fanout"},"consumers":[{"name":"a"}]}`}, transport.RabbitMQ, ""},
		{"rabbitmq secret and URL credentials", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_URL": "amqp://u:p@h/v", "FIFOBOX_AMQP_SECRET_ARN": "arn:s"}, "", "FIFOBOX_AMQP_SECRET_ARN"},
		{"rabbitmq secret but no secret reader", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_SECRET_ARN": "arn:s"}, "", "FIFOBOX_AMQP_SECRET_ARN"},
		{"rabbitmq bad URL", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_URL": "http://h"}, "", "FIFOBOX_AMQP_URL"},
		{"rabbitmq unknown topology", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_TOPOLOGY": "nope"}, "", "FIFOBOX_AMQP_TOPOLOGY"},
		{"rabbitmq refuses an SNS setting", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_DLQ_URL": "d"}, "", "FIFOBOX_DLQ_URL"},
		{"nats refuses a topic", map[string]string{"FIFOBOX_TRANSPORT": "nats", "FIFOBOX_TOPIC_ARN": "arn:t"}, "", "FIFOBOX_TOPIC_ARN"},
		{"secret without its transport", map[string]string{"FIFOBOX_AMQP_SECRET_ARN": "arn:s"}, "", "FIFOBOX_TRANSPORT"},
		{"unknown transport", map[string]string{"FIFOBOX_TRANSPORT": "kafka"}, "", "FIFOBOX_TRANSPORT"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clearTransportEnv(t)
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			tr, err := transport.Open(context.Background(), transport.Options{})
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case tt.wantErr == "" && tr.Kind() != tt.want:
				t.Fatalf("kind %s, want %s", tr.Kind(), tt.want)
			}
			if tr != nil {
				_ = tr.Close()
			}
		})
	}
}

// The secret's credentials end up in the URL the client dials, and a bad
// secret fails with the variable's name and never its value.
func TestOpenReadsTheSecret(t *testing.T) {
	const password = "s3cret-Pa55word/with?odd@chars"
	tests := []struct{ name, secret, wantErr string }{
		{"user", `{"username":"fifobox","password":"` + password + `"}`, ""},
		{"without password", `{"username":"fifobox"}`, "FIFOBOX_AMQP_SECRET_ARN"},
		{"not JSON", password, "FIFOBOX_AMQP_SECRET_ARN"},
		{"unreadable", "", "FIFOBOX_AMQP_SECRET_ARN"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clearTransportEnv(t)
			t.Setenv("FIFOBOX_TRANSPORT", "rabbitmq")
			t.Setenv("FIFOBOX_AMQP_URL", "amqps://b-1.mq.us-east-1.amazonaws.com:5671/prod")
			t.Setenv("FIFOBOX_AMQP_SECRET_ARN", "arn:amqp")
			fetch := func(_ context.Context, arn string) (string, error) {
				if tt.secret == "" {
					return "", errors.New("AccessDeniedException")
				}
				if arn != "arn:amqp" {
					return "", errors.New("wrong secret")
				}
				return tt.secret, nil
			}
			tr, err := transport.Open(context.Background(), transport.Options{Secret: fetch})
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case err != nil && strings.Contains(err.Error(), password):
				t.Fatalf("error carries the secret: %v", err)
			case err != nil:
				return
			}
			defer tr.Close()
			u := tr.(*amqp.Transport).Config().URL
			if !strings.HasPrefix(u, "amqps://fifobox:") || !strings.HasSuffix(u, "@b-1.mq.us-east-1.amazonaws.com:5671/prod") {
				t.Errorf("URL %s", u)
			}
			if s := tr.(*amqp.Transport).String(); strings.Contains(s, "fifobox:") || strings.Contains(s, "s3cret") {
				t.Errorf("String() carries credentials: %s", s)
			}
		})
	}
}
