package lambdafn_test

import (
	"context"
	"errors"
	"os"
	"strings"
	"testing"

	"github.com/fifobox/fifobox/pkg/lambdafn"
	"github.com/fifobox/fifobox/pkg/transport"
)

// clearBrokerEnv unsets every variable BrokerFromEnv reads (the machine
// running the test may set some).
func clearBrokerEnv(t *testing.T) {
	t.Helper()
	for _, v := range lambdafn.BrokerEnv {
		t.Setenv(v.Name, "")
	}
}

func TestBrokerFromEnv(t *testing.T) {
	tests := []struct {
		name    string
		env     map[string]string
		want    transport.Kind
		wantErr string // a variable the error must name
	}{
		{"default is sns", nil, transport.SNS, ""},
		{"rabbitmq with a secret", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_URL": "amqps://b-1.mq.us-east-1.amazonaws.com:5671", "FIFOBOX_AMQP_SECRET_ARN": "arn:s"}, transport.RabbitMQ, ""},
		{"rabbitmq topology as JSON", map[string]string{"FIFOBOX_TRANSPORT": "RabbitMQ", "FIFOBOX_AMQP_TOPOLOGY": `{"exchange":{"name":"x","kind":"fanout"},"consumers":[{"name":"a"}]}`}, transport.RabbitMQ, ""},
		{"rabbitmq secret and URL credentials", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_URL": "amqp://u:p@h/v", "FIFOBOX_AMQP_SECRET_ARN": "arn:s"}, "", "FIFOBOX_AMQP_SECRET_ARN"},
		{"rabbitmq bad URL", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_URL": "http://h"}, "", "FIFOBOX_AMQP_URL"},
		{"rabbitmq unknown topology", map[string]string{"FIFOBOX_TRANSPORT": "rabbitmq", "FIFOBOX_AMQP_TOPOLOGY": "nope"}, "", "FIFOBOX_AMQP_TOPOLOGY"},
		{"nats with a secret", map[string]string{"FIFOBOX_TRANSPORT": "nats", "FIFOBOX_NATS_URL": "tls://nats.internal:4222", "FIFOBOX_NATS_SECRET_ARN": "arn:s"}, transport.NATS, ""},
		{"nats secret and user", map[string]string{"FIFOBOX_TRANSPORT": "nats", "FIFOBOX_NATS_SECRET_ARN": "arn:s", "FIFOBOX_NATS_USER": "u", "FIFOBOX_NATS_PASSWORD": "p"}, "", "FIFOBOX_NATS_SECRET_ARN"},
		{"nats bad URL", map[string]string{"FIFOBOX_TRANSPORT": "nats", "FIFOBOX_NATS_URL": "http://h:4222"}, "", "FIFOBOX_NATS_URL"},
		{"secret without its transport", map[string]string{"FIFOBOX_AMQP_SECRET_ARN": "arn:s"}, "", "FIFOBOX_TRANSPORT"},
		{"unknown transport", map[string]string{"FIFOBOX_TRANSPORT": "kafka"}, "", "FIFOBOX_TRANSPORT"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clearBrokerEnv(t)
			for k, v := range tt.env {
				t.Setenv(k, v)
			}
			b, err := lambdafn.BrokerFromEnv()
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case tt.wantErr == "" && b.Kind != tt.want:
				t.Fatalf("kind %s, want %s", b.Kind, tt.want)
			}
		})
	}
}

// The secret's credentials end up where each client reads them, and a bad
// secret fails with the variable's name and never its value.
func TestBrokerCredentials(t *testing.T) {
	const password = "s3cret-Pa55word/with?odd@chars"
	tests := []struct {
		name, kind, secret, wantErr string
		check                       func(t *testing.T, b lambdafn.Broker)
	}{
		{"amqp user", "rabbitmq", `{"username":"fifobox","password":"` + password + `"}`, "", func(t *testing.T, b lambdafn.Broker) {
			if !strings.HasPrefix(b.AMQP.URL, "amqps://fifobox:") || !strings.HasSuffix(b.AMQP.URL, "@b-1.mq.us-east-1.amazonaws.com:5671/prod") {
				t.Errorf("URL %s", b.AMQP.URL)
			}
		}},
		{"amqp without password", "rabbitmq", `{"username":"fifobox"}`, "FIFOBOX_AMQP_SECRET_ARN", nil},
		{"amqp not JSON", "rabbitmq", password, "FIFOBOX_AMQP_SECRET_ARN", nil},
		{"nats user", "nats", `{"username":"fifobox","password":"` + password + `"}`, "", func(t *testing.T, b lambdafn.Broker) {
			if b.NATS.User != "fifobox" || b.NATS.Password != password {
				t.Errorf("user %q", b.NATS.User)
			}
		}},
		{"nats token", "nats", `{"token":"` + password + `"}`, "", func(t *testing.T, b lambdafn.Broker) {
			if b.NATS.Token != password {
				t.Error("token not set")
			}
		}},
		{"nats creds", "nats", `{"creds":"-----BEGIN NATS USER JWT-----\nx\n"}`, "", func(t *testing.T, b lambdafn.Broker) {
			got, err := os.ReadFile(b.NATS.CredsFile)
			if err != nil || !strings.HasPrefix(string(got), "-----BEGIN NATS USER JWT-----\nx") {
				t.Errorf("creds file %s: %q %v", b.NATS.CredsFile, got, err)
			}
			if st, err := os.Stat(b.NATS.CredsFile); err != nil || st.Mode().Perm() != 0o600 {
				t.Errorf("creds file mode %v %v, want 0600", st.Mode(), err)
			}
		}},
		{"nats two kinds", "nats", `{"token":"t","username":"u","password":"p"}`, "FIFOBOX_NATS_SECRET_ARN", nil},
		{"unreadable", "nats", "", "FIFOBOX_NATS_SECRET_ARN", nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			clearBrokerEnv(t)
			t.Setenv("TMPDIR", t.TempDir())
			t.Setenv("FIFOBOX_TRANSPORT", tt.kind)
			t.Setenv("FIFOBOX_AMQP_URL", "amqps://b-1.mq.us-east-1.amazonaws.com:5671/prod")
			t.Setenv("FIFOBOX_AMQP_SECRET_ARN", "arn:amqp")
			t.Setenv("FIFOBOX_NATS_URL", "tls://nats.internal:4222")
			t.Setenv("FIFOBOX_NATS_SECRET_ARN", "arn:nats")
			if tt.kind == "nats" {
				t.Setenv("FIFOBOX_AMQP_SECRET_ARN", "")
			}
			b, err := lambdafn.BrokerFromEnv()
			if err != nil {
				t.Fatal(err)
			}
			fetch := func(_ context.Context, arn string) (string, error) {
				if tt.secret == "" {
					return "", errors.New("AccessDeniedException")
				}
				if arn != b.SecretARN {
					return "", errors.New("wrong secret")
				}
				return tt.secret, nil
			}
			err = b.Credentials(context.Background(), fetch)
			switch {
			case tt.wantErr == "" && err != nil:
				t.Fatalf("unexpected error: %v", err)
			case tt.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tt.wantErr)):
				t.Fatalf("error %v, want one naming %s", err, tt.wantErr)
			case err != nil && strings.Contains(err.Error(), password):
				t.Fatalf("error carries the secret: %v", err)
			}
			if tt.check != nil {
				tt.check(t, b)
			}
		})
	}
}
