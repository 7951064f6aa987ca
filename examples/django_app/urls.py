from django.urls import path
from shop.views import orders

urlpatterns = [path("orders", orders)]
